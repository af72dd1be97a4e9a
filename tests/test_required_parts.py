"""The GPU proof's exit (cpkit.validation.required_parts, proof_report.verdict): a run that tested
less than it should fails and names what did not run, unless the caller named it optional; a green
run over its budget passes unless the overrun flag is set. Small junit files, no GPU."""

from __future__ import annotations

import json

import pytest

from cpkit.validation import proof_report
from cpkit.validation.required_parts import RequiredPartsError, missing_dependency_skips, parse_optional, violations

PASS = '<testcase classname="functional.test_gpt" name="test_gpt[nccl2-p2p]" time="1"/>'
TE_SKIP = ('<testcase classname="functional.test_te_backend" name="test_te[nccl2-p2p]" time="0"><skipped type="pytest.skip" '
           'message="Transformer Engine is not importable (No module named \'transformer_engine\'); install it">s</skipped></testcase>')
MLM_SKIP = ('<testcase classname="tests.test_dynamic_mlm" name="test_plan" time="0"><skipped type="pytest.skip" '
            'message="CPKIT_MLM_SRC is not set: point it at a Megatron-LM checkout (dev)">s</skipped></testcase>')
BRIDGE_SKIP = ('<testcase classname="functional.test_bridge_hcp" name="test_hcp" time="0"><skipped type="pytest.skip" '
               'message="Megatron-Bridge not found: set CPKIT_BRIDGE_SRC to a checkout\'s src/ directory">s</skipped></testcase>')
OWN_SKIP = ('<testcase classname="functional.test_attention" name="test_w" time="0"><skipped type="pytest.skip" '
            'message="block outside the window">s</skipped></testcase>')
XFAIL = ('<testcase classname="functional.test_gpt" name="test_x" time="0"><skipped type="pytest.xfail" '
         'message="could not import upstream fix">s</skipped></testcase>')


def _junit(tmp_path, *cases):
    path = tmp_path / "junit.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>')
    return path


def test_a_te_skip_fails_the_run_naming_te(tmp_path):
    found = violations(_junit(tmp_path, PASS, TE_SKIP))
    assert len(found) == 1 and "Transformer Engine [te] is required: 1 test(s) skipped" in found[0]
    assert "functional.test_te_backend::test_te[nccl2-p2p]" in found[0] and "--optional te" in found[0]


def test_a_missing_upstream_checkout_fails_naming_it(tmp_path):
    found = violations(_junit(tmp_path, PASS, MLM_SKIP, BRIDGE_SKIP))
    assert [line.split(" is required")[0] for line in found] == [
        "Megatron-Bridge checkout (CPKIT_BRIDGE_SRC) [bridge]", "Megatron-LM checkout (CPKIT_MLM_SRC) [mlm]"]


def test_a_part_the_set_up_lacks_fails_even_when_no_test_skipped_for_it(tmp_path):
    found = violations(_junit(tmp_path, PASS), absent={"mlm": "no .upstream/mlm.tar.xz"})
    assert found == ["Megatron-LM checkout (CPKIT_MLM_SRC) [mlm] is required and missing in the set-up: "
                     "no .upstream/mlm.tar.xz (fix: carry its files (scripts/GPU_CI.md), or name it optional: --optional mlm)"]


def test_named_optional_parts_pass(tmp_path):
    junit = _junit(tmp_path, PASS, TE_SKIP, MLM_SKIP, BRIDGE_SKIP)
    assert violations(junit, parse_optional("te,upstream"), absent={"bridge": "not carried"}) == []
    assert violations(junit, parse_optional("all")) == []
    assert [v.split(" [")[1][:3] for v in violations(junit, parse_optional("upstream"))] == ["te]"]


def test_a_skip_that_names_no_dependency_and_an_xfail_are_not_violations(tmp_path):
    junit = _junit(tmp_path, PASS, OWN_SKIP, XFAIL)
    assert missing_dependency_skips(junit) == [] and violations(junit) == []


def test_an_unknown_missing_dependency_counts_as_other(tmp_path):
    skip = PASS.replace("/>", '><skipped type="pytest.skip" message="git is not installed">s</skipped></testcase>')
    assert missing_dependency_skips(_junit(tmp_path, skip))[0][0] == "other"


def test_an_unknown_optional_name_is_refused_with_the_field_and_a_fix():
    with pytest.raises(RequiredPartsError) as info:
        parse_optional("te,tranformer")
    text = str(info.value)
    assert "CPKIT_OPTIONAL=te,tranformer: 'tranformer' is not a part" in text
    assert "bridge" in text and "fix: e.g. CPKIT_OPTIONAL=te,upstream" in text


def test_a_file_that_is_not_junit_is_a_clear_error(tmp_path):
    bad = tmp_path / "junit.xml"
    bad.write_text("not xml")
    with pytest.raises(ValueError, match="junit.xml: not a readable junit XML file"):
        missing_dependency_skips(bad)


def _evidence(tmp_path, *cases):
    """An evidence folder: the multi-GPU tier's junit of `cases` beside a green gpu1 tier's and a
    green one of the multi-GPU tests that start their own ranks."""
    _junit(tmp_path, PASS.replace("test_gpt", "test_kernels_gpu")).rename(tmp_path / "junit-gpu1.xml")
    _junit(tmp_path, PASS.replace("test_gpt", "test_launcher")).rename(tmp_path / "junit-launch.xml")
    _junit(tmp_path, *cases)
    (tmp_path / "case-times.jsonl").write_text(json.dumps({"example": "x", "t0": 0, "t1": 1}) + "\n")
    return tmp_path


def test_a_green_run_over_budget_passes_unless_the_overrun_flag_is_set(tmp_path):
    folder = _evidence(tmp_path, PASS)
    text, passed = proof_report.verdict(folder, gpus=2, pytest_s=253, total_s=300)
    assert passed and "budget overrun reported, not failed (--fail-over-budget fails it): pytest 253 s > 240 s" in text
    text, passed = proof_report.verdict(folder, gpus=2, pytest_s=253, total_s=300, fail_over_budget=True)
    assert not passed and "FAIL: over budget: pytest 253 s > 240 s" in text


def test_the_skips_of_several_junit_files_are_read_together(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    found = violations([_junit(tmp_path / "a", PASS, TE_SKIP), _junit(tmp_path / "b", TE_SKIP.replace("nccl2", "gpu1"))])
    assert len(found) == 1 and "Transformer Engine [te] is required: 2 test(s) skipped" in found[0]


def test_the_report_exits_1_naming_te_and_0_when_te_is_optional(tmp_path, capsys):
    folder = _evidence(tmp_path, PASS, TE_SKIP)
    common = [str(folder), "--gpus", "2", "--pytest-s", "100", "--total-s", "150"]
    assert proof_report.main(common) == 1
    assert "FAIL: Transformer Engine [te]" in (folder / "README.md").read_text()
    assert proof_report.main(common + ["--optional", "te", "--absent", "te=te-install.sh failed"]) == 0
    assert "- pass" in capsys.readouterr().out


def test_a_bad_absent_item_is_a_usage_error_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        proof_report.main([str(_evidence(tmp_path, PASS)), "--absent", "tee"])
    assert info.value.code == 2 and "--absent tee: must be PART=WHY" in capsys.readouterr().err
