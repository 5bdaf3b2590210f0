"""Only what pyproject.toml cannot say: the source folder ``assets/`` is installed as the
package ``meshnode_assets`` (a top-level ``assets`` package would clash with other
projects). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["meshnode", "meshnode.*", "ui", "ui.*"]), "meshnode_assets"],
    package_dir={"meshnode_assets": "assets"},
)
