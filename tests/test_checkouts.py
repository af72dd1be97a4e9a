"""The identity of an upstream checkout a run used (cpkit.upstream.checkouts): its commit where one can be
read, else a fingerprint of its Python files that changes with them and only with them."""

from __future__ import annotations

import subprocess

from cpkit.upstream.checkouts import checkout_identity, content_fingerprint, upstream_identities


def _tree(root, text="x = 1\n"):
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "a.py").write_text(text)
    (root / "README.md").write_text("not code")
    return root


def test_a_copy_without_git_is_named_by_its_python_files(tmp_path):
    one, two = _tree(tmp_path / "one"), _tree(tmp_path / "two")
    assert checkout_identity(one) == checkout_identity(two) == f"content-{content_fingerprint(one)}"
    (two / "README.md").write_text("other prose")  # not code: the same identity
    assert content_fingerprint(two) == content_fingerprint(one)
    (two / "megatron" / "core" / "a.py").write_text("x = 2\n")
    assert content_fingerprint(two) != content_fingerprint(one)
    (one / "megatron" / "core" / "a.py").rename(one / "megatron" / "b.py")  # same bytes, other path
    assert content_fingerprint(one) != content_fingerprint(_tree(tmp_path / "three"))


def test_a_checkout_or_its_parent_is_named_by_its_commit(tmp_path):
    root = _tree(tmp_path / "bridge")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "."], check=True)
    subprocess.run(["git", "-C", str(root), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "x"],
                   check=True)
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert checkout_identity(root) == head
    assert checkout_identity(root / "megatron") == head  # Bridge is given as <checkout>/src


def test_the_environment_names_each_upstream_checkout(tmp_path):
    tree = _tree(tmp_path / "mlm")
    got = upstream_identities({"CPKIT_MLM_SRC": str(tree), "CPKIT_BRIDGE_SRC": str(tmp_path / "gone")})
    assert got == {"megatron_lm": f"content-{content_fingerprint(tree)}",
                   "megatron_bridge": f"missing: CPKIT_BRIDGE_SRC={tmp_path / 'gone'}"}
    assert upstream_identities({}) == {}


def test_every_bench_json_records_the_upstream_checkouts(tmp_path, monkeypatch):
    from cpkit.bench.common import machine_info

    tree = _tree(tmp_path / "mlm")
    monkeypatch.setenv("CPKIT_MLM_SRC", str(tree))
    monkeypatch.delenv("CPKIT_BRIDGE_SRC", raising=False)
    assert machine_info()["upstream"] == {"megatron_lm": f"content-{content_fingerprint(tree)}"}


def test_a_bridge_copy_without_git_is_named_by_content_not_unknown(tmp_path):
    from cpkit.upstream.bridge import bridge_commit

    src = _tree(tmp_path / "bridge") / "megatron"
    assert bridge_commit(src) == f"content-{content_fingerprint(src)}"
