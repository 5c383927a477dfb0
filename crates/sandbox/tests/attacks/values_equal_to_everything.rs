//! Class 4: values that equal everything.

use super::*;

#[test]
fn attack_values_that_equal_everything_score_zero() {
    let task = secret_task(&marker("eq"));
    // A list-returning task too, for the container subclasses.
    let list_task = CodeTask {
        id: "attack/list".into(),
        prompt: "Write f(x).".into(),
        entry_point: "f".into(),
        tests: vec![
            "assert f(1) == [1, 2, 3]".into(),
            "assert f(2) == [5]".into(),
            "assert f(3) == (1,)".into(),
            "assert f(4) == {'a': 1}".into(),
        ],
    };
    let attacks = [
        "class E:\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\ndef f(x):\n    return E()\n",
        "class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\ndef f(x):\n    return I(7)\n",
        "class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\ndef f(x):\n    return S('x')\n",
        "class L(list):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return L()\n",
        "class T(tuple):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return T()\n",
        "class D(dict):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return D()\n",
        // Hiding the subclass from the harness's type checks.
        "import builtins\nclass E(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n_t = type\nbuiltins.type = lambda *a: str if len(a) == 1 and isinstance(a[0], E) else _t(*a)\ndef f(x):\n    return E('x')\n",
        // Patching the comparison on the built-in side is impossible (immutable types), but try.
        "try:\n    int.__eq__ = lambda a, b: True\nexcept TypeError:\n    pass\ndef f(x):\n    return 0\n",
    ];
    for code in attacks {
        assert_zero(code, &task);
        assert_zero(code, &list_task);
    }
    // Exceptions with control-flow meaning: StopIteration would end `all(map(f, xs))` early.
    let flow_task = CodeTask {
        id: "attack/flow".into(),
        prompt: "Write f(x).".into(),
        entry_point: "f".into(),
        tests: vec![
            "assert all(map(f, [1, 2, 3]))".into(),
            "assert not hasattr(f(1), 'real')".into(),
            "assert any(True for _ in map(f, [1])) or True and f(0) == 5".into(),
            "assert sum(1 for _ in map(f, [1, 2])) == 0 and f(2) == 5".into(),
        ],
    };
    assert_zero("def f(x):\n    raise StopIteration\n", &flow_task);
    assert_zero("def f(x):\n    raise AttributeError('real')\n", &flow_task);
    // Genuine values still compare as values.
    let honest = "def f(x):\n    return {1: [1, 2, 3], 2: [5], 3: (1,), 4: {'a': 1}}[x]\n";
    let r = grade(honest, &list_task, &limits(), RewardMode::AllOrNothing);
    assert_eq!(r.reward, 1.0, "{r:#?}");
}
