"""Packaging: every package folder is installed under its rankscope.* name."""

from __future__ import annotations

import tomllib

from repo_paths import ROOT


def test_every_package_folder_is_listed_in_pyproject() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs: dict[str, str] = cfg["package-dir"]
    expected = set()
    for pkg, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            if any(part in {"__pycache__", "build"} for part in rel):
                continue
            name = ".".join([pkg, *rel])
            # a sub-folder mapped on its own (rankscope.tui is not rankscope.tui under core/)
            if not any(name.startswith(k + ".") or name == k for k in dirs if k != pkg and len(k) > len(pkg)):
                expected.add(name)
    assert expected <= listed, f"missing from [tool.setuptools] packages: {sorted(expected - listed)}"
    assert listed <= expected | set(dirs), f"listed but absent: {sorted(listed - expected - set(dirs))}"
