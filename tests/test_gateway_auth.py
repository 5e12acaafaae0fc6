"""Bearer-token tables (gateway/auth.py) and what a client may read of an error
(protos.rpc.public_message): plain Python."""

import pytest

from gateway.auth import TokenTable, Unauthenticated
from protos.rpc import public_message

TOKENS = """# token            client
alpha-0123456789abcdef  team-a
beta-0123456789abcdef   team-b   # trailing comment
"""


def test_a_token_names_its_client_and_anything_else_is_refused():
    table = TokenTable.parse(TOKENS)
    assert table.authenticate("Bearer alpha-0123456789abcdef") == "team-a"
    assert table.authenticate("bearer   beta-0123456789abcdef ") == "team-b"
    for bad in (None, "", "Bearer", "Basic alpha-0123456789abcdef", "Bearer alpha-0123456789abcde",
                "Bearer alpha-0123456789abcdefX", "alpha-0123456789abcdef"):
        with pytest.raises(Unauthenticated):
            table.authenticate(bad)


@pytest.mark.parametrize("text, why", [
    ("", "no token"),
    ("only-a-token-0123456789\n", "line 1: expected `TOKEN CLIENT`"),
    ("short a\n", "line 1: the token is shorter than 16"),
    ("alpha-0123456789abcdef a\nalpha-0123456789abcdef b\n", "line 2: the token is listed twice"),
])
def test_a_bad_table_is_refused_naming_the_line(text, why):
    with pytest.raises(ValueError, match=why):
        TokenTable.parse(text)


def test_tables_load_from_a_file_or_an_environment_variable(tmp_path, monkeypatch):
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    assert TokenTable.load(str(path)).authenticate("Bearer beta-0123456789abcdef") == "team-b"
    monkeypatch.setenv("GRAMSERVE_TEST_TOKENS", TOKENS)
    table = TokenTable.load("env:GRAMSERVE_TEST_TOKENS")
    assert table.authenticate("Bearer alpha-0123456789abcdef") == "team-a"
    with pytest.raises(ValueError, match="GRAMSERVE_TEST_MISSING is not set"):
        TokenTable.load("env:GRAMSERVE_TEST_MISSING")
    with pytest.raises(ValueError, match="cannot read"):
        TokenTable.load(str(tmp_path / "missing"))


def test_client_messages_lose_library_source_paths():
    gloo = ("worker rank failed: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] "
            "Connection closed by peer [127.0.0.1]:29400")
    assert public_message(gloo) == "worker rank failed: Connection closed by peer [127.0.0.1]:29400"
    assert public_message("x: ../third_party/gloo/a.cc:1 timed out") == "x: timed out"
    assert public_message("Timed out: /usr/lib/python3/site-packages/torch/c10d.py:12: y") == \
        "Timed out: y"
    for kept in ("constraint.regex: bad escape at 3, see https://example.org/re.py",
                 "spec.choice.choices: is empty", "expected a .py file"):
        assert public_message(kept) == kept
