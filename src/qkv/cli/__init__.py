"""The `qkv` command line: thin functions over the library (see main.py)."""
