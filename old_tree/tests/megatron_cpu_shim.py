"""Test-process entry to the CPU shim for Megatron's alltoall dispatcher."""

from megatron_mok.testing import install_cpu_alltoall_shim as install  # noqa: F401
