"""Parameter values that are not of the parameter's type: one line that names the parameter and says
what it takes (no Python conversion error in the user's face)."""
import pytest

from labkit.params import BadInput, Param, parse_size, parse_value

REPEATS = Param("repeats", "int", 5, "")
CONTEXTS = Param("context_lens", "list[int]", "auto", "")
PROBE = Param("probe", "bool", True, "")
SCALE = Param("scale", "float", 1.0, "")


@pytest.mark.parametrize("param,raw,line", [
    (REPEATS, "abc", "parameter repeats: 'abc' is not a whole number"),
    (REPEATS, "2.5", "parameter repeats: '2.5' is not a whole number"),
    (REPEATS, "nan", "parameter repeats: 'nan' is not a whole number"),
    (CONTEXTS, "8K,lots", "parameter context_lens: 'lots' is not a whole number"),
    (PROBE, "maybe", "parameter probe: 'maybe' is not true or false"),
    (SCALE, "fast", "parameter scale: 'fast' is not a number"),
])
def test_bad_value_is_one_plain_line(param, raw, line):
    with pytest.raises(BadInput) as ex:
        parse_value(param, raw)
    msg = str(ex.value)
    assert msg.startswith(line), msg
    assert "\n" not in msg and "could not convert" not in msg and "cannot read" not in msg


def test_good_values_still_read():
    assert parse_value(REPEATS, "7") == 7
    assert parse_value(CONTEXTS, "256,8K,1M") == [256, 8192, 1 << 20]
    assert parse_value(PROBE, "off") is False and parse_value(PROBE, "yes") is True and parse_value(PROBE, False) is False
    assert parse_size("248k") == 248 << 10
    with pytest.raises(ValueError):
        parse_size("inf")
