"""cpkit.tools.fatbin_prune and cpkit.tools.wheel_rewrite on synthetic fatbins, ELF files and wheels
built here (byte layouts written out independently of the module's structs)."""

from __future__ import annotations

import hashlib
import base64
import struct
import zipfile

import pytest

from cpkit.tools.fatbin_prune import (elf_section, main, parse_archs, prune_library_bytes, prune_section,
                                      walk_fatbins)
from cpkit.tools.wheel_rewrite import rewrite_members


def entry(arch: int, payload: bytes, header_size: int = 64, kind: int = 2) -> bytes:
    """A fatbin entry: kind, version, header size, payload size, then arch at byte 28; the rest
    of the header is filled with a non-zero pattern so that a bit-exact copy is checked."""
    head = bytearray(b"\xa5" * header_size)
    head[0:16] = struct.pack("<HHIQ", kind, 0x0101, header_size, len(payload))
    head[28:32] = struct.pack("<I", arch)
    return bytes(head) + payload


def fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def payload(seed: int, n: int = 40) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 + 1 for i in range(n))  # never zero


def two_fatbins() -> tuple[bytes, list[bytes]]:
    e = [entry(80, payload(1)), entry(90, payload(2, 48)), entry(100, payload(3), header_size=112),
         entry(90, payload(4, 24), header_size=120), entry(120, payload(5))]
    return fatbin(e[0], e[1], e[2]) + fatbin(e[3], e[4]), e


def test_walk_reads_every_fatbin_and_entry():
    section, _ = two_fatbins()
    fatbins = walk_fatbins(section)
    assert [f.archs for f in fatbins] == [[80, 90, 100], [90, 120]]
    assert fatbins[1].offset == fatbins[0].end == 16 + 64 + 40 + 64 + 48 + 112 + 40
    assert [e.payload_size for e in fatbins[0].entries] == [40, 48, 40]


def test_prune_keeps_asked_entries_bit_exactly_in_place_and_zeroes_the_rest():
    section, e = two_fatbins()
    pruned = bytearray(section)
    report = prune_section(pruned, (90,))
    assert len(pruned) == len(section)
    second = len(fatbin(e[0], e[1], e[2]))
    # First fatbin: header with the fat size shrunk to its sm_90 entry, that entry byte for byte,
    # then zeros up to where the second fatbin still starts.
    assert pruned[:16] == struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(e[1]))
    assert pruned[16:16 + len(e[1])] == e[1]
    assert pruned[16 + len(e[1]):second] == bytes(second - 16 - len(e[1]))
    assert pruned[second:second + 16] == struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(e[3]))
    assert pruned[second + 16:second + 16 + len(e[3])] == e[3]
    assert not any(pruned[second + 16 + len(e[3]):])
    assert (report.fatbins, report.entries_kept, report.entries_dropped) == (2, 2, 3)
    assert report.bytes_kept == len(e[1]) + len(e[3])
    assert report.bytes_zeroed == len(e[0]) + len(e[2]) + len(e[4])
    assert report.arch_bytes == {80: len(e[0]), 90: len(e[1]) + len(e[3]), 100: len(e[2]), 120: len(e[4])}
    # The pruned section walks again (zeros between fatbins), and a second prune changes nothing.
    assert [f.archs for f in walk_fatbins(pruned)] == [[90], [90]]
    again = bytearray(pruned)
    prune_section(again, (90,))
    assert again == pruned


def test_prune_keeps_several_archs_in_their_order():
    section, e = two_fatbins()
    pruned = bytearray(section)
    prune_section(pruned, parse_archs("sm_120,sm_80,90"))
    assert pruned[16:16 + len(e[0]) + len(e[1])] == e[0] + e[1]
    assert [f.archs for f in walk_fatbins(pruned)] == [[80, 90], [90, 120]]


def test_prune_refuses_a_fatbin_without_the_asked_arch_and_changes_nothing():
    section, _ = two_fatbins()
    pruned = bytearray(section)
    with pytest.raises(ValueError, match=r"1 of 2 fatbins would keep no entry for sm_100: fatbin 1 at section "
                                         r"offset 384 \(file offset 1384\) has sm_90, sm_120"):
        prune_section(pruned, (100,), base_offset=1000)
    assert pruned == section


@pytest.mark.parametrize("damage, message", [
    (lambda s: b"\x51" + s[1:], r"fatbin 0 at offset 0 has magic 0xba55ed51, expected 0xba55ed50"),
    (lambda s: s[:-8], r"fatbin 1 at offset 384 declares .* bytes of entries, 8 more than the section holds"),
    (lambda s: s + b"\x50\xed", r"2 bytes at offset 648 are too few for a fatbin header"),
    (lambda s: s[:4] + struct.pack("<H", 2) + s[6:], r"fatbin 0 at offset 0 has version 2"),
    (lambda s: s[:20] + struct.pack("<I", 32) + s[24:], r"fatbin 0, entry 0 at offset 16 has an entry header of 32"),
    (lambda s: s[:24] + struct.pack("<Q", 10**6) + s[32:], r"fatbin 0, entry 0 at offset 16 .* runs \d+ bytes past"),
])
def test_walk_refuses_a_section_it_cannot_walk(damage, message):
    section, _ = two_fatbins()
    with pytest.raises(ValueError, match="cannot walk .nv_fatbin: " + message):
        walk_fatbins(damage(section))


def test_walk_refuses_an_entry_header_cut_by_the_fatbin_end():
    body = entry(90, payload(1))
    cut = struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body) + 20) + body + b"\x01" * 20
    with pytest.raises(ValueError, match=r"fatbin 0, entry 1 at offset 120: 20 bytes left .* truncated"):
        walk_fatbins(cut)


@pytest.mark.parametrize("text, archs", [("sm_90", (90,)), ("90, sm_100a", (90, 100)), ("sm_90a,sm_90", (90,))])
def test_parse_archs(text, archs):
    assert parse_archs(text) == archs


def test_parse_archs_refuses_a_bad_token():
    with pytest.raises(ValueError, match=r"'compute_90' is not an architecture.*sm_90,sm_100"):
        parse_archs("sm_90,compute_90")


def elf64(sections: dict[str, bytes], ident_class: int = 2, ident_data: int = 1) -> bytes:
    """A minimal ELF image: header, the sections' bytes, a section-name table and the section
    headers (a null one, .shstrtab, then `sections` in order)."""
    names = b"\0.shstrtab\0" + b"".join(n.encode() + b"\0" for n in sections)
    image = bytearray(64)
    layout = []  # (name offset, file offset, size)
    name_at = len(b"\0.shstrtab\0")
    for name, data in sections.items():
        layout.append((name_at, len(image), len(data)))
        name_at += len(name) + 1
        image += data
    strtab = len(image)
    image += names
    image += bytes(-len(image) % 8)
    shoff = len(image)
    image += bytes(64)  # null section header
    image += struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, strtab, len(names), 0, 0, 1, 0)
    for name_off, off, size in layout:
        image += struct.pack("<IIQQQQIIQQ", name_off, 1, 2, off, off, size, 0, 0, 8, 0)
    image[0:16] = b"\x7fELF" + bytes([ident_class, ident_data, 1]) + bytes(9)
    struct.pack_into("<Q", image, 0x28, shoff)
    struct.pack_into("<HHHH", image, 0x38, 0, 64, 2 + len(sections), 1)  # e_phnum, shentsize, shnum, shstrndx
    return bytes(image)


def test_prune_library_changes_only_the_section():
    section, _ = two_fatbins()
    host_code = b"\x90" * 100
    image = elf64({".text": host_code, ".nv_fatbin": section, ".data": b"\x42" * 24})
    offset, size = elf_section(image)
    assert image[offset:offset + size] == section
    pruned = bytearray(image)
    prune_library_bytes(pruned, (90,))
    expected = bytearray(section)
    prune_section(expected, (90,))
    assert pruned[offset:offset + size] == expected
    assert pruned[:offset] == image[:offset] and pruned[offset + size:] == image[offset + size:]


@pytest.mark.parametrize("image, message", [
    (b"MZ" + bytes(100), r"not an ELF file"),
    (elf64({".nv_fatbin": b""}, ident_class=1), r"ELF class 1, data encoding 1: only 64-bit little-endian"),
    (elf64({".nv_fatbin": b""}, ident_data=2), r"data encoding 2: only 64-bit little-endian"),
    (elf64({".text": b"\x90" * 8}), r"no .nv_fatbin section"),
    (elf64({".nv_fatbin": b"x" * 8})[:72], r"section header table .* does not fit"),
])
def test_elf_section_refuses_what_it_cannot_read(image, message):
    with pytest.raises(ValueError, match=message):
        elf_section(image)


def record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def write_wheel(path, files: dict[str, bytes]) -> None:
    record = "\n".join(record_line(p, d) for p, d in files.items()) + "\npkg-1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        for p, d in files.items():
            wheel.writestr(p, d)
        wheel.writestr("pkg-1.dist-info/RECORD", record)


def test_cli_prunes_the_library_in_a_wheel_and_updates_its_record(tmp_path, capsys):
    section, _ = two_fatbins()
    library = elf64({".nv_fatbin": section})
    source, target = tmp_path / "pkg-1-py3-none-any.whl", tmp_path / "out.whl"
    write_wheel(source, {"pkg/__init__.py": b"x = 1\n", "pkg/lib/libtransformer_engine.so": library,
                         "pkg-1.dist-info/METADATA": b"Name: pkg\n"})
    assert main([str(source), "-o", str(target), "--arch", "sm_90", "--json", str(tmp_path / "r.json")]) == 0
    assert "kept 2 entries" in capsys.readouterr().out
    expected = bytearray(library)
    prune_library_bytes(expected, (90,))
    with zipfile.ZipFile(target) as wheel:
        assert wheel.read("pkg/lib/libtransformer_engine.so") == expected
        assert wheel.read("pkg/__init__.py") == b"x = 1\n"
        record = wheel.read("pkg-1.dist-info/RECORD").decode().splitlines()
        assert all(i.compress_type == zipfile.ZIP_STORED for i in wheel.infolist())
    assert record_line("pkg/lib/libtransformer_engine.so", bytes(expected)) in record
    assert record_line("pkg/__init__.py", b"x = 1\n") in record and "pkg-1.dist-info/RECORD,," in record


def test_cli_reports_a_refused_library_and_writes_nothing(tmp_path, capsys):
    section, _ = two_fatbins()
    (tmp_path / "lib.so").write_bytes(elf64({".nv_fatbin": section}))
    assert main([str(tmp_path / "lib.so"), "-o", str(tmp_path / "out.so"), "--arch", "sm_100"]) == 1
    assert "would keep no entry for sm_100" in capsys.readouterr().err
    assert not (tmp_path / "out.so").exists()


def test_rewrite_refuses_a_wheel_without_the_member(tmp_path):
    write_wheel(tmp_path / "a.whl", {"pkg/__init__.py": b""})
    with pytest.raises(ValueError, match=r"no member matches"):
        rewrite_members(tmp_path / "a.whl", tmp_path / "b.whl", [r".*\.so"], lambda n, d: d)
