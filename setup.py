"""Builds csrc/ into spliceway._relay; all other metadata lives in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["csrc/relay_build.py:ffibuilder"])
