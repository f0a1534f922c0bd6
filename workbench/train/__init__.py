"""The QAT trainer: config, shipped corpus, loop, DCP checkpoint/resume (entry: `cli.main`)."""
