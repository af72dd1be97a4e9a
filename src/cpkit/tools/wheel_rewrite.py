"""Rewrite a wheel with some of its files changed, keeping its RECORD true.

`pip install` of the result installs the changed files, and the RECORD (the wheel's list of
files with their sha256 and size) names their new hashes, so a later `pip uninstall` or an
integrity check sees what is on disk. The rewritten wheel is stored without zip compression:
it is meant to travel inside an xz archive, which compresses far better than zip's deflate
(a pruned library is mostly zeros and host code).
"""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from pathlib import Path
from typing import Callable

__all__ = ["record_hash", "rewrite_members"]


def record_hash(data: bytes) -> str:
    """The RECORD form of a file's hash: `sha256=` and the urlsafe base64 digest without padding."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def rewrite_members(source: Path, target: Path, patterns: list[str],
                    transform: Callable[[str, bytes], bytes]) -> list[str]:
    """Copy wheel `source` to `target`, passing every member whose path fully matches one of the
    regular expressions `patterns` through `transform(path, data)`, and updating those members'
    lines in the RECORD. Returns the changed members' paths. Raises ValueError when no member
    matches or the wheel has no RECORD; `target` is written only when everything succeeded."""
    compiled = [re.compile(p) for p in patterns]
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(source) as wheel:
        infos = wheel.infolist()
        records = [i for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename)]
        if len(records) != 1:
            raise ValueError(f"{source.name}: expected one *.dist-info/RECORD, found {len(records)}: not a wheel")
        matched = [i.filename for i in infos if any(p.fullmatch(i.filename) for p in compiled)]
        if not matched:
            raise ValueError(f"{source.name}: no member matches {patterns}; members that look like libraries: "
                             f"{[i.filename for i in infos if '.so' in i.filename]}")
        try:
            _copy(wheel, records[0], set(matched), transform, partial)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    partial.replace(target)
    return matched


def _stored(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    copy = zipfile.ZipInfo(info.filename, date_time=info.date_time)
    copy.external_attr = info.external_attr
    copy.compress_type = zipfile.ZIP_STORED
    return copy


def _copy(wheel: zipfile.ZipFile, record: zipfile.ZipInfo, matched: set[str],
          transform: Callable[[str, bytes], bytes], path: Path) -> None:
    """Write every member of `wheel` to `path`, the matched ones transformed, the RECORD last."""
    changed: dict[str, str] = {}
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as out:
        for info in wheel.infolist():
            if info.filename == record.filename:
                continue
            data = wheel.read(info)
            if info.filename in matched:
                data = transform(info.filename, data)
                changed[info.filename] = f"{info.filename},{record_hash(data)},{len(data)}"
            out.writestr(_stored(info), data)
        lines = wheel.read(record).decode().splitlines()
        listed = {line.split(",", 1)[0] for line in lines}
        lines = [changed.get(line.split(",", 1)[0], line) for line in lines]
        lines += [changed[name] for name in sorted(set(changed) - listed)]
        out.writestr(_stored(record), "\n".join(lines) + "\n")
