"""The workers' shared harness (tests/workers/_harness.py): the lines a check prints, the SUMMARY line other tools
grep, and the bit comparisons (numpy only, no JAX backend)."""
import numpy as np

from conftest import harness

H = harness()


def _lines(capsys):
    return capsys.readouterr().out.splitlines()


def test_check_style_lines_and_summary(capsys):
    c = H.Checks(decimals=1)
    c.run("good", lambda: (True, "ignored"))
    c.run("bad", lambda: (False, "why"))
    c.expect("raises", lambda: 1 / 0)
    out = _lines(capsys)
    assert out[0].startswith("CHECK good PASS (") and out[0].endswith("s)")
    assert out[1].startswith("CHECK bad FAIL (") and out[1].endswith("s) why")
    assert out[2].startswith("CHECK raises FAIL (") and "ZeroDivisionError: division by zero" in out[2]
    assert c.results == {"good": True, "bad": False, "raises": False} and c.failed == ["bad", "raises"]
    assert c.errors == {"raises": "ZeroDivisionError: division by zero"}
    c.summary("x_check", "cpu", "2 ranks")
    assert _lines(capsys) == ["SUMMARY x_check: 1 passed, 2 failed (cpu, 2 ranks) FAILED: bad, raises"]
    H.Checks().summary("y_check", "cpu", failed_sep=": ")
    assert _lines(capsys) == ["SUMMARY y_check: 0 passed, 0 failed (cpu)"]


def test_pass_style_and_select(capsys):
    c = H.Checks(style="PASS", select=lambda n: n != "skipped")

    @c.case("ok")
    def _():
        pass

    @c.case("skipped")
    def _():
        raise AssertionError("must not run")

    @c.case("broken")
    def _():
        raise AssertionError("no")

    out = [l for l in _lines(capsys) if l.startswith(("PASS", "FAIL"))]
    assert len(out) == 2 and out[0].startswith("PASS ok (") and out[1] == "FAIL broken: AssertionError: no"
    assert c.passed == ["ok"] and c.failed == ["broken"]


def test_bits_compare_floats_by_bits_and_ints_by_value():
    nan = np.array([np.nan], np.float32)
    assert H.same(nan, nan) and not H.same(np.float32([0.0]), np.float32([-0.0]))
    assert H.same(np.int32([-1, 5]), np.int64([-1, 5]))  # values, not widths
    assert H.raw_bits(np.int16([-1]))[0] == 0xFFFF and H.raw_bits(np.bool_([True])).dtype == np.bool_
    assert not H.same(np.zeros((2, 1)), np.zeros((1, 2)))


def test_random_bits_and_ids():
    rng = np.random.default_rng(0)
    for dt in (np.float16, np.float32, H.FP8, np.dtype("bfloat16")):
        v = H.random_bits(rng, (4096,), dt).astype(np.float32)
        assert np.isfinite(v).all(), dt
    ids = H.make_ids(3, 64, 5, 100)
    assert ids.dtype == np.int32 and ids.shape == (64, 5)
    assert np.array_equal(ids, H.make_ids(np.random.default_rng(3), 64, 5, 100))
    assert ((ids >= 100) | (ids < 0)).any() and ((ids >= 0) & (ids < 100)).any()
    valid = H.make_ids(4, 64, 5, 100, special=False)
    assert ((valid >= 0) & (valid < 100)).all()
