"""The one build step pyproject.toml cannot declare: the cpu backend's C++ kernels, compiled
for this machine when the package is built or installed (an editable install too), so that the
first `pagedllm generate` does not compile them (backends/cpu/kernel_build.py)."""

import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _kernel_build():
    path = os.path.join(HERE, "backends", "cpu", "kernel_build.py")
    spec = importlib.util.spec_from_file_location("pagedllm_kernel_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        kernel_build = _kernel_build()
        # an editable install imports the package from this folder; a wheel from build_lib
        root = HERE if getattr(self, "editable_mode", False) else os.path.join(self.build_lib, "pagedllm")
        print(kernel_build.prebuild(os.path.join(root, "backends", "cpu", "prebuilt")))


setup(cmdclass={"build_py": BuildPyWithKernels})
