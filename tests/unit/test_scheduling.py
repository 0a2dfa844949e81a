"""tests/scheduling.py: whole test files, longest first, each file's tests in their order."""

from tests.scheduling import UNKNOWN_TEST_S, file_of, longest_files_first


def test_files_come_longest_first_and_keep_their_tests_in_order() -> None:
    ids = ["a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "c.py::t2", "c.py::t3"]
    # b 50 s, a 10 s, c unknown: 3 tests x 1 s
    order = longest_files_first(ids, {"a.py": 10.0, "b.py": 50.0})
    assert [ids[i] for i in order] == [
        "b.py::t1", "a.py::t1", "a.py::t2", "c.py::t1", "c.py::t2", "c.py::t3"
    ]  # fmt: skip
    assert UNKNOWN_TEST_S * 3 < 10.0


def test_ties_keep_collection_order_and_nothing_is_lost() -> None:
    ids = ["x.py::a", "y.py::a", "x.py::b", "z.py::a"]
    order = longest_files_first(ids, {"x.py": 5.0, "y.py": 5.0, "z.py": 9.0})
    # x's tests come together (collection put y between them), ahead of y: x came first
    assert [ids[i] for i in order] == ["z.py::a", "x.py::a", "x.py::b", "y.py::a"]
    assert sorted(order) == list(range(len(ids)))
    assert longest_files_first([], {}) == []
    assert file_of("tests/e2e/test_up.py::test_x[param::y]") == "tests/e2e/test_up.py"
