"""What a prebuilt Transformer Engine PyTorch extension needs of a host, and whether this host has it.

TE's extension is C++ built against one torch, one Python and the builder's glibc: a wheel built
on glibc 2.38 does not load on a host with 2.36, and one built for another torch does not import.
scripts/te-bundle.sh records each bundled extension's needs in the bundle's manifest
(`torch_ext_needs`); scripts/te-install.sh checks them first and stops with the reason.

    python -m cpkit.validation.te_ext_needs record WHEEL KEY    # the needs, as JSON
    python -m cpkit.validation.te_ext_needs check BUNDLE [--can-build]
    python -m cpkit.validation.te_ext_needs import-check         # torch first, then TE

A key is torch<torch.__version__, + as _>-te<TE version>-cp<python>, e.g. torch2.11.0_cu130-te2.20.2-cp312.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tarfile
import zipfile
from pathlib import Path

__all__ = ["glibc_needed", "needs_of", "host_needs", "unmet", "main"]

_KEY = re.compile(r"torch(?P<torch>.+)-te(?P<te>[\d.]+)-cp(?P<py>\d)(?P<minor>\d+)")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def glibc_needed(wheel: str | Path) -> str | None:
    """The newest GLIBC_x.y symbol version any shared library in the wheel asks for, or None."""
    found: set[str] = set()
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if ".so" in name.rsplit("/", 1)[-1]:
                found |= {m.decode() for m in re.findall(rb"GLIBC_(\d+\.\d+(?:\.\d+)?)", zf.read(name))}
    return max(found, key=_version) if found else None


def needs_of(wheel: str | Path, key: str) -> dict[str, str | None]:
    """{glibc, torch, python} that the extension wheel built for `key` needs."""
    match = _KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"key {key!r}: must read torch<version>-te<version>-cp<python>, "
                         "e.g. torch2.11.0_cu130-te2.20.2-cp312; fix: name the wheel cache's folder so")
    return {"glibc": glibc_needed(wheel), "torch": match["torch"].replace("_", "+"),
            "python": f"{match['py']}.{match['minor']}"}


def host_needs(te_version: str) -> tuple[str, dict[str, str | None]]:
    """(this host's key for `te_version`, {glibc, torch, python} it has). Imports torch."""
    import torch

    glibc = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()[-1:] or [None]
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    key = f"torch{torch.__version__}-te{te_version}-cp{py.replace('.', '')}".replace("+", "_")
    return key, {"glibc": glibc[0], "torch": torch.__version__, "python": py}


def unmet(needs_by_key: dict[str, dict], key: str, host: dict[str, str | None]) -> list[str]:
    """Why the bundle's prebuilt extension will not serve this host (key, host from host_needs); []
    when it will."""
    if key not in needs_by_key:
        have = ", ".join(f"torch {n['torch']} / Python {n['python']}" for n in needs_by_key.values()) or "none"
        return [f"the bundle has no prebuilt TE extension for this host's torch {host['torch']} and Python "
                f"{host['python']} (key {key}; it has: {have}); fix: run scripts/te-bundle.sh --build-torch-ext "
                f"with TE_TORCH_VERSION={str(host['torch']).split('+')[0]}, or install nvcc here to build it"]
    needs = needs_by_key[key]
    if needs.get("glibc") and host.get("glibc") and _version(needs["glibc"]) > _version(host["glibc"]):
        return [f"the bundle's TE extension for {key} needs glibc {needs['glibc']}, this host has {host['glibc']}; "
                f"fix: build it on a host with glibc <= {host['glibc']} (scripts/te-bundle.sh --build-torch-ext "
                "there), or install nvcc here so te-install.sh builds it"]
    return []


def _manifest(bundle: Path) -> dict:
    """The bundle's manifest.json: a .json file as is, or the first member of the .tar.xz."""
    if bundle.suffix == ".json":
        return json.loads(bundle.read_text())
    with tarfile.open(bundle, "r|xz") as tar:  # streamed: manifest.json is the first member
        for member in tar:
            if member.name.endswith("/manifest.json"):
                return json.load(tar.extractfile(member))
    raise ValueError(f"{bundle}: no manifest.json; fix: make the bundle again with scripts/te-bundle.sh")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpkit.validation.te_ext_needs", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    record = sub.add_parser("record", allow_abbrev=False, help="print the needs of an extension wheel as JSON")
    record.add_argument("wheel", type=Path)
    record.add_argument("key")
    check = sub.add_parser("check", allow_abbrev=False, help="exit 1, saying why, when this host does not meet them")
    check.add_argument("bundle", type=Path)
    check.add_argument("--can-build", action="store_true", help="nvcc is here: unmet needs only warn (te-install builds)")
    sub.add_parser("import-check", allow_abbrev=False, help="import torch, then transformer_engine.pytorch")
    args = parser.parse_args(argv)
    if args.command == "record":
        print(json.dumps(needs_of(args.wheel, args.key)))
        return 0
    if args.command == "import-check":
        import torch  # noqa: F401  first: TE's library finds torch's NCCL (libnccl.so.2) only once torch loaded it
        import transformer_engine.pytorch  # noqa: F401
        return 0
    manifest = _manifest(args.bundle)
    if "torch_ext_needs" not in manifest:
        print(f"te-install: {args.bundle} states no extension needs (made by an older te-bundle.sh); "
              "fix: make it again with scripts/te-bundle.sh --build-torch-ext", file=sys.stderr)
        return 1
    key, host = host_needs(manifest["te_version"])
    problems = unmet(manifest["torch_ext_needs"], key, host)
    for problem in problems:
        print(f"te-install: {'warning: ' if args.can_build else ''}{problem}", file=sys.stderr)
    if not problems:
        print(f"te-install: this host meets the prebuilt extension's needs ({key}, glibc {host['glibc']})")
    return 1 if problems and not args.can_build else 0


if __name__ == "__main__":
    sys.exit(main())
