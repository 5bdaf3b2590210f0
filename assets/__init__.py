"""meshnode's data files: the icon (SVG and PNG sizes), an example ``config.toml`` and an
example ``model-package.json``.

In a checkout this folder is ``assets/``; in the wheel it is the package
``meshnode_assets`` (``setup.py`` maps one onto the other). Code reaches the files
through :func:`meshnode.assets.asset`, which works in both and in the PyInstaller app.
"""
