"""The optional C kernel (distro_opt/csrc/fdct.c, see distro_opt/native.py); everything else about the
package is in pyproject.toml. The kernel is a plain C library that the package loads with ctypes: it
needs neither torch nor Python headers to build, and where it cannot be built (no compiler, not Linux)
the package installs without it and uses its GEMM path."""
import sys

from setuptools import Extension, setup


def native_kernels():
    if not sys.platform.startswith("linux"):
        return []
    return [
        Extension(
            "distro_opt._fdct",
            sources=["distro_opt/csrc/fdct.c"],
            depends=["distro_opt/csrc/fdct_body.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,  # a failed build leaves the package without the kernel, not uninstallable
        )
    ]


setup(ext_modules=native_kernels())
