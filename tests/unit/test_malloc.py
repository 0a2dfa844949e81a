"""streamrl.run.malloc: the workers' GLIBC_TUNABLES (transparent huge pages for malloc)."""

from __future__ import annotations

from streamrl.run.malloc import with_hugetlb


def test_hugetlb_is_added_to_an_environment_without_tunables() -> None:
    env = {"PATH": "/bin"}
    assert with_hugetlb(env) == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert env == {"PATH": "/bin"}  # a copy


def test_the_users_other_tunables_are_kept() -> None:
    got = with_hugetlb({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert got["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert with_hugetlb({"GLIBC_TUNABLES": ""})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


def test_a_users_own_hugetlb_wins() -> None:
    for mine in ("glibc.malloc.hugetlb=0", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"):
        assert with_hugetlb({"GLIBC_TUNABLES": mine})["GLIBC_TUNABLES"] == mine
