"""Tests of ``scripts/``: the GPU check, the rooms' import levels, the documentation samples."""
