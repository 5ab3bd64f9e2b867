"""Setuptools shim: the metadata lives in setup.cfg; the package list is found here, not written by hand.

``bridgeflow/`` and its subpackages are found as they are; ``adapters/`` and its subpackages are installed under
``bridgeflow.adapters`` (setup.cfg's ``package_dir``), never as a top-level ``adapters`` (an unrelated PyPI
package has that name). setup.cfg alone cannot say this: its ``find:`` names packages by their folders.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["bridgeflow", "bridgeflow.*"])
      + ["bridgeflow." + name for name in find_packages(include=["adapters", "adapters.*"])])
