"""Everything about the package is in pyproject.toml but the one thing it cannot say: the
repository's ``assets/`` folder (the app's stylesheet, the README's screenshots) ships inside the
package as ``app/assets`` — the stylesheet only, the screenshots stay out of the wheel.
``app.paths.asset`` finds it there when installed and in ``assets/`` in a checkout."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["app", "app.*"]), "app.assets"],
    package_dir={"app.assets": "assets"},  # which of its files ship: pyproject.toml's package-data
)
