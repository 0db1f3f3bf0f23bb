"""Maps the design's top-level folders onto one import name: backend/ is `tritium`, kernels/,
frontend/ and client/ are `tritium.kernels`, `tritium.frontend` and `tritium.client`, and the
load generator, benchmarks/loadgen/, is `tritium.bench` (`tritium bench` runs it).
Everything else about the package is in pyproject.toml."""
from setuptools import find_packages, setup

FOLDERS = {"tritium": "backend", "tritium.kernels": "kernels", "tritium.frontend": "frontend",
           "tritium.client": "client", "tritium.bench": "benchmarks/loadgen"}


def _packages() -> list[str]:
    names = []
    for name, folder in FOLDERS.items():
        names.append(name)
        names.extend(f"{name}.{sub}" for sub in find_packages(folder))
    return names


setup(packages=_packages(), package_dir=FOLDERS)
