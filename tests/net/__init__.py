"""Tests of graphdist._net: the bind shim, who may connect, where servers listen, ports."""
