from setuptools import find_packages, setup

setup(
    name="megatron-entropy",
    version="0.1.0",
    description=("RL for reasoning LLMs on Megatron-Core that keeps policy entropy from collapsing "
                 "(Clip-Cov and KL-Cov, Cui et al. 2025)"),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_entropy", "megatron_entropy.*"]),
    # Not a package: a folder put on a vLLM CPU server's PYTHONPATH (rollout/server/vllm.py).
    package_data={"megatron_entropy.rollout.server": ["vllm_cpu_site/sitecustomize.py"]},
    # Ranges a GPU cluster can meet with its own builds; CPU machines pin exact versions through
    # constraints-cpu.txt (see README).
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1",
        "numpy",
        "pyyaml",
        "transformers>=4.51",
        "safetensors",
        "tokenizers",
        "psutil",  # without it dist_checkpointing saves can hang
        "tqdm",
        "math-verify",
        "pyarrow",
        "matplotlib",
        "aiohttp",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout"],
        "gpu": ["transformer-engine[pytorch]"],
        "vllm": ["vllm"],
        "sglang": ["sglang", "sglang-router"],
        "logging": ["tensorboard", "wandb"],
    },
    entry_points={"console_scripts": ["megatron-entropy=megatron_entropy.cli:main"]},
)
