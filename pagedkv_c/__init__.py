"""Compiled core of pagedkv (Cython). Use the public API in ``pagedkv`` instead."""
