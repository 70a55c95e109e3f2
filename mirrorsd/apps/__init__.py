"""The commands built on the runtime: the ``mirrorsd`` CLI (cli), ``mirrorsd plan`` (plan), ``mirrorsd bench`` (bench,
bench_report, bandwidth) and the peer systems the bench compares against (peers)."""
