"""The test suite: one subpackage per room of the package a test proves (``tests.<room>.<module>``,
with the support modules only that room uses); the support modules several rooms share are
imported as ``tests.<module>``."""
