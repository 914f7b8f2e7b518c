"""Build script: the pure-Python package, plus the optional CUDA extension macs_kernels._C (see csrc/)."""
from setuptools import find_packages, setup

setup(
    name="macs_kernels",
    version="0.1.0",
    description="Token attribution from attention (MACS, AT2, efficient attention) inside FlashAttention-style inference",
    packages=find_packages(include=["macs_kernels", "macs_kernels.*"]),
    package_data={"macs_kernels": ["data/*"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=4.56",
        "safetensors",
        "tqdm",
        "rich",
        "matplotlib",
        "numpy",
    ],
    extras_require={
        "triton": ["triton>=3.1"],
        "gguf": ["gguf>=0.10", "accelerate"],
        "eval": ["datasets", "rouge-score", "scikit-learn"],
        "test": ["pytest", "pytest-benchmark", "scikit-learn"],
    },
    entry_points={"console_scripts": ["macs-kernels=macs_kernels.cli:main"]},
)
