//! The repository grader on code that is not plain functions: objects that keep state across
//! calls, methods, operators, iteration, the repository's own exceptions and classes, callbacks
//! into the test — and the attacks that these open (objects equal to everything, swallowed
//! failures, exits, forged messages, hangs).

use std::time::Duration;

use composer_env::repo::grade::run_hidden_tests;
use composer_sandbox::{Sandbox, SandboxLimits};

/// A repository with state, classes, exceptions, generators and higher-order functions.
const SHAPES: &str = r#"
"""Shapes and containers."""

UNIT = 1.0
NAMES = ["circle", "square"]


class ShapeError(ValueError):
    """A shape that cannot exist."""

    def __init__(self, message, size=None):
        super().__init__(message)
        self.size = size


class EmptyError(IndexError):
    pass


class Square:
    sides = 4

    def __init__(self, side):
        if side <= 0:
            raise ShapeError("side must be positive", side)
        self.side = side

    def area(self):
        return self.side * self.side

    @staticmethod
    def unit():
        return Square(1)

    @classmethod
    def of_area(cls, area):
        return cls(int(area ** 0.5))

    def __eq__(self, other):
        return isinstance(other, Square) and other.side == self.side

    def __lt__(self, other):
        return self.side < other.side

    def __hash__(self):
        return hash(self.side)

    def __repr__(self):
        return "Square(%d)" % self.side

    def __add__(self, other):
        return Square(self.side + other.side)


class Stack:
    def __init__(self):
        self.items = []

    def push(self, x):
        self.items.append(x)
        return self

    def pop(self):
        if not self.items:
            raise EmptyError("pop from an empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(reversed(self.items))

    def __contains__(self, x):
        return x in self.items

    def __getitem__(self, i):
        return self.items[i]

    def __setitem__(self, i, x):
        self.items[i] = x

    def __bool__(self):
        return bool(self.items)


class Opened:
    log = []

    def __enter__(self):
        Opened.log.append("enter")
        return self

    def __exit__(self, *exc):
        Opened.log.append("exit")
        return False


def count_up(n):
    for i in range(n):
        yield i


def group_by(items, key):
    out = {}
    for x in items:
        out.setdefault(key(x), []).append(x)
    return out


def total_area(shapes):
    return sum(s.area() for s in shapes)


def sort_in_place(xs):
    xs.sort()


def mean(xs):
    return sum(xs) / len(xs)
"#;

const TESTS: &str = r#"
from shapes.geo import Square, Stack, ShapeError, EmptyError, Opened, UNIT, NAMES
from shapes import geo
import shapes.geo


def test_state_and_methods():
    s = Stack()
    s.push(1).push(2)
    s.push(3)
    assert len(s) == 3
    assert s.pop() == 3
    assert list(s) == [2, 1]
    assert 1 in s and 7 not in s
    s[0] = 10
    assert s[0] == 10
    assert s.items == [10, 2]
    assert s


def test_classes_and_operators():
    a = Square(2)
    assert a.area() == 4
    assert a.side == 2
    a.side = 3
    assert a.area() == 9
    assert Square.sides == 4
    assert Square.unit() == Square(1)
    assert Square.of_area(16) == Square(4)
    assert a + Square(1) == Square(4)
    assert Square(1) < Square(2)
    assert sorted([Square(3), Square(1)]) == [Square(1), Square(3)]
    assert repr(a) == "Square(3)" and str(a) == "Square(3)" and f"{a}" == "Square(3)"
    assert isinstance(a, Square) and not isinstance(3, Square)
    assert len({Square(2), Square(2)}) == 1


def test_repository_exceptions():
    try:
        Square(-1)
    except ShapeError as e:
        assert e.size == -1
        assert "positive" in str(e)
        assert isinstance(e, ValueError)
    else:
        assert False, "no ShapeError"
    try:
        Stack().pop()
    except IndexError as e:
        assert isinstance(e, EmptyError)
    else:
        assert False, "no EmptyError"
    try:
        geo.mean([])
    except ZeroDivisionError:
        pass
    else:
        assert False


def test_module_values_and_import_styles():
    star = {}
    exec("from shapes.geo import *", {"__builtins__": __builtins__}, star)
    assert star["Square"](2).area() == 4 and star["UNIT"] == 1.0 and "ShapeError" in star
    assert UNIT == 1.0 and NAMES == ["circle", "square"]
    assert shapes.geo.Square(5).area() == 25
    assert geo.total_area([Square(1), Square(2)]) == 5


def test_generators_callbacks_and_in_place_changes():
    assert list(geo.count_up(3)) == [0, 1, 2]
    assert sum(geo.count_up(4)) == 6
    words = ["apple", "avocado", "banana"]
    assert geo.group_by(words, key=lambda w: w[0]) == {"a": ["apple", "avocado"], "b": ["banana"]}
    assert geo.group_by([Square(1), Square(2), Square(1)], lambda s: s.area()) == {
        1: [Square(1), Square(1)], 4: [Square(2)]}
    xs = [3, 1, 2]
    geo.sort_in_place(xs)
    assert xs == [1, 2, 3]


def test_context_manager():
    with Opened() as o:
        assert o is not None
    assert Opened.log == ["enter", "exit"]


def test_mean_is_close():
    assert abs(geo.mean([1, 2, 4]) - 7 / 3) < 1e-9
"#;

fn sandbox_with(files: &[(&str, &str)]) -> Sandbox {
    let limits = SandboxLimits {
        wall_time: Duration::from_secs(60),
        cpu_time_s: 60,
        ..SandboxLimits::default()
    };
    let sb = Sandbox::new(limits).expect("sandbox");
    for (path, text) in files {
        sb.write_file(path, text.as_bytes()).unwrap();
    }
    sb
}

/// Runs `tests` (as `test_geo.py`) against the `shapes` package in `sb`.
fn run(sb: &Sandbox, tests: &str) -> Vec<(String, bool, String)> {
    run_hidden_tests(
        sb,
        &["shapes".to_string()],
        &[("test_geo.py".to_string(), tests.to_string())],
        Duration::from_secs(60),
    )
    .expect("the judge runs")
}

/// Grades `geo` (the module's text) with `tests`; `(test, passed, error)` per test.
fn grade(geo: &str, tests: &str) -> Vec<(String, bool, String)> {
    run(
        &sandbox_with(&[("shapes/__init__.py", ""), ("shapes/geo.py", geo)]),
        tests,
    )
}

fn passed(verdicts: &[(String, bool, String)], test: &str) -> bool {
    verdicts
        .iter()
        .find(|v| v.0 == format!("test_geo::{test}"))
        .unwrap_or_else(|| panic!("no verdict for {test}: {verdicts:?}"))
        .1
}

#[test]
fn honest_code_with_objects_passes_every_test() {
    let v = grade(SHAPES, TESTS);
    assert_eq!(v.len(), 7, "{v:?}");
    for (test, ok, err) in &v {
        assert!(ok, "{test}: {err}");
    }
}

#[test]
fn broken_methods_fail_only_their_tests() {
    let broken = SHAPES.replace(
        "    def area(self):\n        return self.side * self.side",
        "    def area(self):\n        raise NotImplementedError",
    );
    let v = grade(&broken, TESTS);
    assert!(!passed(&v, "test_classes_and_operators"));
    assert!(!passed(&v, "test_module_values_and_import_styles"));
    assert!(passed(&v, "test_state_and_methods"), "{v:?}");
    assert!(passed(&v, "test_context_manager"), "{v:?}");
}

/// Objects whose every comparison and operator answers "yes" pass no assertion against a
/// plain value: `==`, `!=`, `<` with a plain value are never asked of the code's objects.
#[test]
fn attack_objects_that_agree_with_everything_fail() {
    let evil = format!(
        "{SHAPES}\n\
         class Yes:\n\
         \x20   def __eq__(self, o): return True\n\
         \x20   def __ne__(self, o): return False\n\
         \x20   def __lt__(self, o): return True\n\
         \x20   def __le__(self, o): return True\n\
         \x20   def __gt__(self, o): return True\n\
         \x20   def __ge__(self, o): return True\n\
         \x20   def __sub__(self, o): return self\n\
         \x20   def __rsub__(self, o): return self\n\
         \x20   def __abs__(self): return self\n\
         \x20   def __bool__(self): return True\n\
         \x20   def __hash__(self): return 0\n\
         \x20   def __iter__(self): return iter(())\n\
         \x20   def __len__(self): return 0\n\
         \n\
         def mean(xs):\n    return Yes()\n\
         def total_area(shapes):\n    return Yes()\n\
         def group_by(items, key):\n    return Yes()\n"
    );
    let v = grade(&evil, TESTS);
    assert!(!passed(&v, "test_mean_is_close"), "{v:?}");
    assert!(!passed(&v, "test_module_values_and_import_styles"), "{v:?}");
    assert!(
        !passed(&v, "test_generators_callbacks_and_in_place_changes"),
        "{v:?}"
    );
    assert!(
        passed(&v, "test_state_and_methods"),
        "the rest still grades: {v:?}"
    );
}

/// A failure of the code's process fails the test even where the test expects an exception
/// (`except Exception`, `except IndexError`): exiting, SystemExit, StopIteration, or dying in
/// the middle of a call never count as the exception the test wanted.
#[test]
fn attack_exits_and_control_flow_exceptions_are_not_the_expected_error() {
    let tests = r#"
from shapes.geo import Stack, mean


def test_pop_empty_raises():
    try:
        Stack().pop()
    except Exception:
        return
    assert False, "no exception"


def test_all_means_positive():
    assert all(map(mean, [[1], [2], [3]]))
"#;
    let honest = grade(SHAPES, tests);
    assert!(honest.iter().all(|v| v.1), "{honest:?}");
    for (pop, mean) in [
        ("import os; os._exit(0)", "raise StopIteration"),
        ("raise SystemExit(0)", "raise AttributeError('x')"),
        ("raise KeyboardInterrupt", "import sys; sys.exit(0)"),
        ("import ctypes; ctypes.string_at(0)", "raise GeneratorExit"),
    ] {
        let evil = SHAPES
            .replace(
                "            raise EmptyError(\"pop from an empty stack\")",
                &format!("            {pop}"),
            )
            .replace(
                "def mean(xs):\n    return sum(xs) / len(xs)",
                &format!("def mean(xs):\n    {mean}"),
            );
        let v = grade(&evil, tests);
        assert!(v.iter().all(|v| !v.1), "{pop} / {mean}: {v:?}");
    }
}

/// Messages the code forges on its channel (replies to requests not made, verdicts, "done")
/// break nothing but its own tests; an `__exit__` that returns True does not swallow a failed
/// assert in the `with` block.
#[test]
fn attack_forged_messages_and_swallowing_exits_fail() {
    let forged = format!(
        "import os\n\
         for line in ['{{\"re\": 2, \"ok\": true, \"value\": true}}', '{{\"done\": true}}',\n\
                      '{{\"test\": \"test_geo::test_mean_is_close\", \"status\": \"pass\"}}']:\n\
         \x20   for fd in range(0, 20):\n\
         \x20       try:\n\
         \x20           os.write(fd, (line + '\\n').encode())\n\
         \x20       except OSError:\n\
         \x20           pass\n\
         {}",
        SHAPES.replace("return sum(xs) / len(xs)", "raise NotImplementedError")
    );
    let v = grade(&forged, TESTS);
    assert!(!passed(&v, "test_mean_is_close"), "{v:?}");
    let swallow = SHAPES.replace(
        "        Opened.log.append(\"exit\")\n        return False",
        "        Opened.log.append(\"exit\")\n        return True",
    );
    let tests = r#"
from shapes.geo import Opened


def test_assert_inside_with():
    with Opened():
        assert 1 == 2
"#;
    let v = grade(&swallow, tests);
    assert!(!passed(&v, "test_assert_inside_with"), "{v:?}");
}

/// The test's callbacks are callable by the code, nothing more: no attributes, no globals.
#[test]
fn attack_callbacks_do_not_reach_the_tests_values() {
    let evil = SHAPES.replace(
        "def group_by(items, key):\n    out = {}",
        "def group_by(items, key):\n\
         \x20   found = []\n\
         \x20   for attr in ('__globals__', '__code__', '__closure__', '__self__', 'n'):\n\
         \x20       try:\n\
         \x20           found.append(repr(getattr(key, attr)))\n\
         \x20       except BaseException as e:\n\
         \x20           found.append(type(e).__name__)\n\
         \x20   if any('avocado' in f or 'banana' in f for f in found):\n\
         \x20       raise SystemExit('leaked: %r' % found)\n\
         \x20   out = {}",
    );
    let v = grade(&evil, TESTS);
    assert!(
        passed(&v, "test_generators_callbacks_and_in_place_changes"),
        "{v:?}"
    );
}

/// A call that never returns fails its test; the next test gets a fresh process.
#[test]
fn a_hanging_call_fails_its_test_and_the_rest_still_grade() {
    let tests = r#"
from shapes.geo import mean, Square


def test_hangs():
    assert mean([1, 2]) == 1.5


def test_after():
    assert Square(2).area() == 4
"#;
    let evil = SHAPES.replace(
        "def mean(xs):\n    return sum(xs) / len(xs)",
        "def mean(xs):\n    while True:\n        pass",
    );
    let v = grade(&evil, tests);
    assert!(!passed(&v, "test_hangs"), "{v:?}");
    assert!(passed(&v, "test_after"), "{v:?}");
    let err = &v.iter().find(|v| v.0 == "test_geo::test_hangs").unwrap().2;
    assert!(err.contains("too long"), "{err}");
}

/// Objects the test module makes at its top are made again in each test's process (fresh
/// each time, as the module-level requests are replayed in order), callbacks included.
#[test]
fn module_level_objects_are_there_fresh_in_every_test() {
    let tests = r#"
from shapes.geo import Square, Stack, group_by

BIG = Square(10)
STACK = Stack().push(1).push(2)
GROUPS = group_by([Square(1), Square(2)], key=lambda s: s.side % 2)


def test_changes_its_objects():
    BIG.side = 3
    assert BIG.area() == 9
    assert STACK.pop() == 2 and len(STACK) == 1


def test_sees_them_fresh():
    assert BIG.area() == 100
    assert len(STACK) == 2
    assert GROUPS[1] == [Square(1)] and GROUPS[0] == [Square(2)]
"#;
    let v = grade(SHAPES, tests);
    assert!(v.iter().all(|v| v.1), "{v:?}");
}

/// A missing module fails each test that uses it, not the file: the count of tests stays.
#[test]
fn a_missing_module_fails_each_test() {
    let v = run(&sandbox_with(&[("shapes/__init__.py", "")]), TESTS);
    assert_eq!(v.len(), 7, "{v:?}");
    assert!(v.iter().all(|v| !v.1), "{v:?}");
}

/// An object whose operators answer plain values (`f(x) - y` → 0.0, `abs(...)` → 0.0) passes
/// no assertion through them: an operator with a plain operand, or a unary numeric one, counts
/// only when it answers another of the code's objects.
#[test]
fn attack_operators_answering_plain_values_fail() {
    let evil = format!(
        "{SHAPES}\n\
         class Zero:\n\
         \x20   def __sub__(self, o): return 0.0\n\
         \x20   def __rsub__(self, o): return 0.0\n\
         \n\
         class AbsZero:\n\
         \x20   def __sub__(self, o): return self\n\
         \x20   def __abs__(self): return 0.0\n\
         \n\
         def mean(xs):\n    return Zero()\n\
         def mean_abs(xs):\n    return AbsZero()\n"
    );
    let tests = r#"
from shapes import geo


def test_sub():
    assert abs(geo.mean([1, 2, 4]) - 7 / 3) < 1e-9


def test_rsub():
    assert abs(7 / 3 - geo.mean([1, 2, 4])) < 1e-9


def test_abs():
    assert abs(geo.mean_abs([1, 2, 4]) - 7 / 3) < 1e-9


def test_objects_still_add():
    assert geo.Square(1) + geo.Square(2) == geo.Square(3)
"#;
    let v = grade(&evil, tests);
    assert_eq!(v.len(), 4, "{v:?}");
    for t in ["test_sub", "test_rsub", "test_abs"] {
        assert!(!passed(&v, t), "{t}: {v:?}");
    }
    assert!(passed(&v, "test_objects_still_add"), "{v:?}");
}

/// A repository exception whose class also derives from StopIteration (the bases are the
/// code's claim) does not end `all(map(f, xs))` early: it fails the test like StopIteration.
#[test]
fn attack_exception_classes_mixing_in_control_flow_fail() {
    let evil = format!(
        "{SHAPES}\n\
         class Stop(ValueError, StopIteration):\n    pass\n\
         \n\
         def check(x):\n    raise Stop('no')\n"
    );
    let tests = r#"
from shapes import geo


def test_all_of_map():
    assert all(map(geo.check, [1, 2, 3]))


def test_for_over_map():
    for r in map(geo.check, [1, 2]):
        assert r == "ok"
"#;
    let v = grade(&evil, tests);
    assert!(!passed(&v, "test_all_of_map"), "{v:?}");
    assert!(!passed(&v, "test_for_over_map"), "{v:?}");
}

/// `from pkg.mod import *` binds neither names that look like tests (the code cannot add
/// tests to the file) nor names of built-ins (a module-level `abs` returning 0 would pass
/// `abs(f(x) - y) < eps`): the tests are the file's own functions, counted from its source.
#[test]
fn attack_star_imports_add_no_tests_and_shadow_no_builtins() {
    let mut evil = SHAPES.replace(
        "def mean(xs):\n    return sum(xs) / len(xs)",
        "def mean(xs):\n    return 0",
    );
    evil.push_str(
        "\ndef abs(x):\n    return 0\n\
         \nfor _i in range(50):\n    globals()['test_free_%d' % _i] = lambda: None\n\
         \nTestAlso = len\n",
    );
    let tests = r#"
from shapes.geo import *


def test_star_mean():
    assert abs(mean([1, 2, 4]) - 7 / 3) < 1e-9


def test_star_square():
    assert Square(2).area() == 4
"#;
    let v = grade(&evil, tests);
    assert_eq!(v.len(), 2, "only the file's own tests: {v:?}");
    assert!(!passed(&v, "test_star_mean"), "{v:?}");
    assert!(passed(&v, "test_star_square"), "{v:?}");
    // The honest module passes both through the star import.
    let v = grade(SHAPES, tests);
    assert!(v.len() == 2 && v.iter().all(|v| v.1), "{v:?}");
}

/// A module top that fails (here because the code raises where the file calls it) fails each
/// of the file's tests: breaking it cannot shrink the count to one failed verdict.
#[test]
fn attack_a_failing_module_top_fails_every_test_of_the_file() {
    let evil = SHAPES.replace(
        "def mean(xs):\n    return sum(xs) / len(xs)",
        "def mean(xs):\n    raise RuntimeError('no')",
    );
    let tests = r#"
from shapes import geo

BASE = geo.mean([2, 2])


def test_one():
    assert BASE == 2


def test_two():
    assert geo.Square(2).area() == 4


def test_three():
    assert geo.UNIT == 1.0
"#;
    let v = grade(&evil, tests);
    assert_eq!(v.len(), 3, "{v:?}");
    assert!(v.iter().all(|v| !v.1), "{v:?}");
    let v = grade(SHAPES, tests);
    assert!(v.len() == 3 && v.iter().all(|v| v.1), "{v:?}");
}

/// Integers past 64 bits and floats travel between the judge and the code as their own bytes:
/// honest code gets its exact values through (arguments and results), and a result one
/// integer or one ulp off fails.
#[test]
fn big_integers_and_floats_travel_exactly() {
    let code = format!(
        "{SHAPES}\n\
         import math\n\
         def fact(n):\n    return math.factorial(n)\n\
         def double(x):\n    return 2 * x\n\
         def near_power():\n    return 2 ** 70 + 12345\n\
         def near_float():\n    return 0.00021659939713061338\n"
    );
    let tests = r#"
from shapes import geo


def test_factorial():
    assert geo.fact(25) == 15511210043330985984000000


def test_big_argument():
    assert geo.double(2 ** 70 + 1) == 2 ** 71 + 2
    assert type(geo.double(2 ** 64)) is int


def test_float_argument():
    assert geo.double(0.00010829969856530669) == 0.00021659939713061338


def test_near_power_is_not_the_power():
    assert geo.near_power() == 2 ** 70


def test_near_float_is_not_the_float():
    assert geo.near_float() == 0.00021659939713061335
"#;
    let v = grade(&code, tests);
    assert_eq!(v.len(), 5, "{v:?}");
    for t in ["test_factorial", "test_big_argument", "test_float_argument"] {
        assert!(passed(&v, t), "{t}: {v:?}");
    }
    assert!(!passed(&v, "test_near_power_is_not_the_power"), "{v:?}");
    assert!(!passed(&v, "test_near_float_is_not_the_float"), "{v:?}");
}

/// What a test sends the code (here `y` of `f(x) - y`, written to a file by the code's
/// `__rsub__`) is gone for the next test: each test's process runs in a fresh copy of the
/// code's sandbox, so the expected value cannot be read back and returned as a plain value.
#[test]
fn attack_operands_kept_on_disk_do_not_reach_the_next_test() {
    let evil = format!(
        "{SHAPES}\n\
         import os\n\
         class Spy:\n\
         \x20   def __sub__(self, o):\n\
         \x20       with open('leak.txt', 'w') as f:\n\
         \x20           f.write(repr(o))\n\
         \x20       return self\n\
         \n\
         def mean(xs):\n\
         \x20   if os.path.exists('leak.txt'):\n\
         \x20       return float(open('leak.txt').read())\n\
         \x20   return Spy()\n"
    );
    let tests = r#"
from shapes import geo


def test_a_probe():
    assert abs(geo.mean([1, 2, 4]) - 7 / 3) < 1e-9


def test_b_equality():
    assert geo.mean([1, 2, 4]) == 7 / 3
"#;
    let v = grade(&evil, tests);
    assert!(!passed(&v, "test_a_probe"), "{v:?}");
    assert!(!passed(&v, "test_b_equality"), "{v:?}");
}

/// `(test, passed, error)` per test, as `run_hidden_tests` gives them.
type Verdicts = Vec<(String, bool, String)>;

/// `run_hidden_tests` with its own budget: the judge's result (an error when grading fails) and
/// how long it took.
fn grade_within(geo: &str, tests: &str, budget_s: u64) -> (anyhow::Result<Verdicts>, Duration) {
    let sb = sandbox_with(&[("shapes/__init__.py", ""), ("shapes/geo.py", geo)]);
    let t = std::time::Instant::now();
    let r = run_hidden_tests(
        &sb,
        &["shapes".to_string()],
        &[("test_geo.py".to_string(), tests.to_string())],
        Duration::from_secs(budget_s),
    );
    (r, t.elapsed())
}

/// A star import leaves alone every name the test file binds itself (`import math`, `from
/// math import isclose`, a helper `close`): the code cannot swap the test's tools for
/// agreeable ones.
#[test]
fn attack_star_imports_do_not_rebind_the_tests_own_names() {
    let evil = format!(
        "{}\n\
         class _M:\n\
         \x20   def isclose(self, *a, **k):\n        return True\n\
         math = _M()\n\
         def isclose(*a, **k):\n    return True\n\
         def close(a, b):\n    return True\n",
        SHAPES.replace(
            "def mean(xs):\n    return sum(xs) / len(xs)",
            "def mean(xs):\n    return 0"
        )
    );
    let tests = r#"
import math
from math import isclose
from shapes.geo import *


def close(a, b):
    return abs(a - b) < 1e-9


def test_math_isclose():
    assert math.isclose(mean([1, 2, 4]), 7 / 3)


def test_isclose():
    assert isclose(mean([1, 2, 4]), 7 / 3, rel_tol=1e-9)


def test_helper():
    assert close(mean([1, 2, 4]), 7 / 3)
"#;
    let v = grade(&evil, tests);
    assert_eq!(v.len(), 3, "{v:?}");
    assert!(v.iter().all(|v| !v.1), "{v:?}");
    let v = grade(SHAPES, tests);
    assert!(v.iter().all(|v| v.1), "the honest module passes: {v:?}");
}

/// A test that is a coroutine or a generator would "pass" without running its body: it fails.
#[test]
fn generator_and_async_tests_fail_instead_of_passing_unrun() {
    let tests = r#"
from shapes import geo


async def test_async():
    assert False


def test_generator():
    assert False
    yield


def test_plain():
    assert geo.UNIT == 1.0
"#;
    let v = grade(SHAPES, tests);
    assert!(!passed(&v, "test_async"), "{v:?}");
    assert!(!passed(&v, "test_generator"), "{v:?}");
    assert!(passed(&v, "test_plain"), "{v:?}");
}

/// Replies the judge cannot read — nested 100,000 deep, an integer of 3,000,000 digits — fail
/// their test even inside `except Exception` (the code broke the protocol), quickly, and the
/// next test still grades.
#[test]
fn attack_unreadable_replies_fail_their_test_quickly() {
    let code = format!(
        "{SHAPES}\n\
         import __main__, os\n\
         _send = __main__.send\n\
         def _hook(obj):\n\
         \x20   if obj.get('value') == 'DEEP':\n\
         \x20       os.write(3, b'{{\"re\": %d, \"ok\": true, \"value\": ' % obj['re'] + b'[' * 100000 + b']' * 100000 + b'}}\\n')\n\
         \x20       return\n\
         \x20   if obj.get('value') == 'HUGE':\n\
         \x20       os.write(3, b'{{\"re\": %d, \"ok\": true, \"value\": ' % obj['re'] + b'9' * 3000000 + b'}}\\n')\n\
         \x20       return\n\
         \x20   _send(obj)\n\
         __main__.send = _hook\n\
         def deep():\n    return 'DEEP'\n\
         def huge():\n    return 'HUGE'\n"
    );
    let tests = r#"
from shapes import geo


def test_a_deep():
    try:
        geo.deep()
    except Exception:
        return
    assert False


def test_b_huge():
    try:
        geo.huge()
    except Exception:
        return
    assert False


def test_c_other():
    assert geo.UNIT == 1.0
"#;
    let (r, took) = grade_within(&code, tests, 60);
    let v = r.expect("the judge finishes");
    assert!(!passed(&v, "test_a_deep"), "{v:?}");
    assert!(!passed(&v, "test_b_huge"), "{v:?}");
    assert!(passed(&v, "test_c_other"), "{v:?}");
    assert!(took < Duration::from_secs(50), "took {took:?}");
}

/// A generator that never ends, consumed by `list()`, is many short turns: the test fails when
/// its share of the grading time runs out, and the tests after it still get theirs.
#[test]
fn an_endless_generator_fails_its_test_not_the_rest() {
    let code = SHAPES.replace(
        "def count_up(n):\n    for i in range(n):\n        yield i",
        "def count_up(n):\n    i = 0\n    while True:\n        yield i\n        i += 1",
    );
    let tests = r#"
from shapes import geo


def test_a_endless():
    assert list(geo.count_up(3)) == [0, 1, 2]


def test_b_other():
    assert geo.UNIT == 1.0
"#;
    let (r, _) = grade_within(&code, tests, 45);
    let v = r.expect("the judge finishes");
    assert!(!passed(&v, "test_a_endless"), "{v:?}");
    assert!(passed(&v, "test_b_other"), "{v:?}");
}

/// A string with a lone surrogate makes the judge's next line unreadable to the parent: grading
/// fails at once (reward 0) instead of waiting out its budget.
#[test]
fn a_line_the_parent_cannot_read_fails_grading_at_once() {
    let code = format!(
        "{SHAPES}\n\
         def name():\n    return '\\udc80'\n\
         def echo(x):\n    return x\n"
    );
    let tests = r#"
from shapes import geo


def test_roundtrip():
    assert geo.echo(geo.name()) == "x"
"#;
    let (r, took) = grade_within(&code, tests, 40);
    let e = format!("{:#}", r.expect_err("grading fails"));
    assert!(e.contains("not JSON"), "{e}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}
