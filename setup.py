"""The package list, which pyproject.toml cannot say: the metadata is in pyproject.toml.

Every folder of megatron_entropy/ with an ``__init__.py`` is a package of the wheel (a folder
without one is left out: tests/integration/test_wheel.py builds the wheel and compares it with
the tree). The top-level examples/ ships inside the package as ``megatron_entropy/examples``
(``megatron-entropy examples DIR`` copies it out of an installed package)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["megatron_entropy", "megatron_entropy.*"])
    + ["megatron_entropy.examples"],
    package_dir={"megatron_entropy.examples": "examples"},
    package_data={
        # Not a package: a folder put on a vLLM CPU server's PYTHONPATH (rollout/server/vllm.py).
        "megatron_entropy.rollout.server": ["vllm_cpu_site/sitecustomize.py"],
        "megatron_entropy.examples": ["*.yaml", "*.md", "*_model/*"],
    },
)
