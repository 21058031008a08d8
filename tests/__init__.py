"""The test suite (a package: its support modules are imported as ``tests.<module>``)."""
