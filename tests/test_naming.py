"""recompile.naming: the one Namer behind generated names (SubGraphs, variables, module-level references,
emitted functions, printed values, function IR names)."""

import keyword

from recompile.naming import Namer


def test_a_base_is_its_own_name_then_numbered_from_two():
    names = Namer()
    assert [names.fresh("h") for _ in range(4)] == ["h", "h_2", "h_3", "h_4"]
    assert names.fresh("c") == "c"


def test_a_name_given_under_another_base_is_skipped():
    names = Namer()
    assert names.fresh("x_2") == "x_2"  # (a user's variable really named x_2)
    assert [names.fresh("x"), names.fresh("x"), names.fresh("x")] == ["x", "x_3", "x_4"]
    assert names.fresh("x_2") == "x_2_2"


def test_refused_and_reserved_names():
    names = Namer(refuse=keyword.iskeyword, reserved=("f",))
    assert names.fresh("if") == "if_2" and names.fresh("f") == "f_2" and "f" in names and "if" not in names
    names.reserve("g")
    assert names.fresh("g") == "g_2"


def test_the_suffix_and_its_start_are_the_namers():
    dotted = Namer(suffix=lambda k: f".{k}", start=1)
    assert [dotted.fresh("v") for _ in range(3)] == ["v", "v.1", "v.2"]
    underscores = Namer(suffix=lambda k: "_" * k, start=1)
    assert [underscores.fresh("p") for _ in range(3)] == ["p", "p_", "p__"]


def test_name_of_gives_a_key_the_same_name_each_time():
    names = Namer()
    a, b = object(), object()
    assert names.name_of(a, "t") == "t" and names.name_of(b, "t") == "t_2" and names.name_of(a, "other") == "t"


def test_the_name_is_the_first_free_one_as_a_scan_would_find():
    # numbering resumes where it stopped for a base, which gives what a scan from the start gives: names once
    # given are never free again
    names, scanned = Namer(), set()

    def scan(base):
        name, k = base, 1
        while name in scanned:
            k += 1
            name = f"{base}_{k}"
        scanned.add(name)
        return name

    for base in ["a", "a", "a_2", "a", "b", "a_3", "a", "a_2", "b"]:
        assert names.fresh(base) == scan(base)
