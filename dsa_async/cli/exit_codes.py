"""The exit codes every ``dsa-async`` subcommand shares."""

EXIT_OK = 0
EXIT_FAILED = 1  #: a runtime failure (a scenario failed, a verdict not OK, an output not written)
EXIT_USAGE = 2  #: bad arguments or configuration
EXIT_DOES_NOT_FIT = 3  #: the host pool asked for does not fit the host memory budget
EXIT_INTERRUPTED = 130  #: stopped by Ctrl-C before there was anything to report (128 + SIGINT)
