"""megatron-bitpipe: the BitPipe pipeline schedule and Optimus 2D tensor parallelism for megatron-core."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent

setup(
    name="megatron-bitpipe",
    version="0.1.0",
    description=(
        "BitPipe bidirectional interleaved pipeline schedule and Optimus 2D tensor "
        "parallelism as a plugin for NVIDIA megatron-core"
    ),
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_bitpipe", "megatron_bitpipe.*"]),
    # megatron-core 0.16 through 0.19 (megatron_bitpipe/megatron_compat.py adapts the API
    # differences); pip on Python 3.11 picks 0.16.x, as 0.17+ declares Requires-Python >=3.12.
    # psutil: megatron-core's distributed-checkpoint writer measures its memory with it
    install_requires=["megatron-core>=0.16,<0.20", "torch>=2.6", "numpy", "psutil"],
    extras_require={
        "test": [
            "pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "matplotlib>=3.7", "ortools>=9.10",
            "schedulefree==1.4.*",  # --optimizer schedulefree_adamw and its reference
            "pytorch-optimizer>=4.1",  # REX oracle
        ],
        # --optimizer schedulefree_adamw
        "schedulefree": ["schedulefree==1.4.*"],
        # exhaustive schedule search (scripts/optimal_schedule.py)
        "search": ["ortools>=9.10"],
        "plot": ["matplotlib>=3.7"],
        # transformer-engine needs CUDA; megatron-core's local layers are used without it.
        "gpu": ["transformer-engine[pytorch]>=2.9"],
        # what Megatron-LM's training code (a checkout, not on PyPI) imports besides megatron-core
        "megatron-lm": ["six", "regex", "pyyaml", "pydantic", "einops", "triton", "pybind11"],
        "tensorboard": ["tensorboard"],
        # megatron-core's Hugging Face based tokenizers (BertWordPiece*, HuggingFaceTokenizer)
        "tokenizers": ["transformers"],
    },
    entry_points={
        "console_scripts": [
            "bitpipe-schedule=megatron_bitpipe.schedules.cli:main",
            "megatron-bitpipe-run=megatron_bitpipe.run:main",
        ]
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: Apache Software License",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
