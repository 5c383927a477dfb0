use composer_sandbox::*;
#[test]
fn smoke() {
    println!("{:#?}", sandbox_capabilities());
    let r = run_python("import os,sys\nprint(os.getpid(), os.getuid(), os.getcwd(), dict(os.environ))\nprint(open('/proc/self/status').read()[:0])\n", &SandboxLimits::default());
    println!("{r:#?}");
    let t = &builtin_tasks()[0];
    let g = grade("def sum_of_evens(n):\n    return 0\n", t, &SandboxLimits::default(), RewardMode::FractionPassed);
    println!("{g:#?}");
}
