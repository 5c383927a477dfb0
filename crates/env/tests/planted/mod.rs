//! Runner-configuration attacks that would win if the grader copied or honoured them.
//!
//! The graded module stays broken, but at import time it executes any of the planted files it
//! finds next to itself or one level up; each planted file holds the CORRECT module source
//! (and, when run by `site`/pytest instead, patches the correct functions into the module).
//! So the score is 0 only because the grader never copies or runs these files; the control
//! (`CONTROL`, an ordinary graded file with the same content) shows the mechanism wins.

/// Runner configuration files the attack plants (repo-relative), each with Python content
/// that would install the correct implementation if run.
pub const PLANTED: &[&str] = &[
    "conftest.py",
    "sitecustomize.py",
    "usercustomize.py",
    "textkit/conftest.py",
    "textkit/sitecustomize.py",
    "textkit/usercustomize.py",
    "textkit/evil.pth",
];

/// A file the grader does take (it matches `textkit/*.py`), holding the same patch.
pub const CONTROL: &str = "textkit/fix.py";

/// The graded module: `broken` (the task's file, function still raising) plus a loader that
/// executes every planted or control file present, in the module's own namespace.
pub fn booby_trapped_module(broken: &str) -> String {
    let mut names: Vec<&str> = PLANTED
        .iter()
        .map(|p| p.rsplit('/').next().unwrap())
        .collect();
    names.push(CONTROL.rsplit('/').next().unwrap());
    names.sort();
    names.dedup();
    format!(
        "{broken}\n\n\
         def _load_planted():\n    \
             import os\n    \
             here = os.path.dirname(os.path.abspath(__file__))\n    \
             for d in (here, os.path.dirname(here)):\n        \
                 for n in {names:?}:\n            \
                     p = os.path.join(d, n)\n            \
                     if os.path.isfile(p):\n                \
                         with open(p) as f:\n                    \
                             exec(compile(f.read(), p, 'exec'), globals())\n\n\n\
         _load_planted()\n"
    )
}

/// Python that defines the correct module (`correct`) and, when not executed inside the
/// graded module itself (run by `site`, a `.pth` line, or pytest), patches its functions into
/// `module` (dotted name).
pub fn patch_source(correct: &str, module: &str) -> String {
    format!(
        "{correct}\n\n\
         if __name__ != {module:?}:\n    \
             import importlib as _il\n    \
             _m = _il.import_module({module:?})\n    \
             for _k, _v in list(globals().items()):\n        \
                 if callable(_v) and not _k.startswith('_'):\n            \
                     setattr(_m, _k, _v)\n"
    )
}

/// The content planted at `path`: the patch itself, or for a `.pth` file one `import` line
/// (the only kind `site` executes) that runs it.
pub fn planted_content(path: &str, patch: &str) -> String {
    if path.ends_with(".pth") {
        format!("import sys; exec({patch:?})\n")
    } else {
        patch.to_string()
    }
}
