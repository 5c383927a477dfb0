# Runs every test_* function of the test_*.py modules beside this file, with the repository
# root on sys.path; prints PASS/FAIL per test and exits 1 when any failed.
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
passed = failed = 0
for fn in sorted(os.listdir(HERE)):
    if not (fn.startswith("test") and fn.endswith(".py")):
        continue
    ns = {"__name__": fn[:-3]}
    try:
        with open(os.path.join(HERE, fn), encoding="utf-8") as f:
            exec(compile(f.read(), fn, "exec"), ns)
    except Exception:
        # A module that cannot be imported (say, a deleted one) fails its file, not the run.
        failed += 1
        print("FAIL %s::<import>" % fn[:-3])
        traceback.print_exc(file=sys.stdout)
        continue
    for name, func in list(ns.items()):
        if name.startswith("test") and callable(func):
            try:
                func()
                passed += 1
                print("PASS %s::%s" % (fn[:-3], name))
            except Exception:
                failed += 1
                print("FAIL %s::%s" % (fn[:-3], name))
                traceback.print_exc(file=sys.stdout)
print("%d passed, %d failed" % (passed, failed))
sys.exit(1 if failed else 0)
