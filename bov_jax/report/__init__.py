"""Reports that only read workdirs: runs and sweeps (`runs`), statistics over seeds (`stats`),
the paper-layout tables (`tables`), figures (`figures`) and report.md (`markdown`).
`python -m bov_jax.report`. Nothing in the trainer imports this package."""
