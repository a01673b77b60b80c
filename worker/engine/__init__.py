"""The engine: one worker process and the pool of them.

Read in this order: ``loop`` (claim, dispatch, acknowledge, stop), ``batch`` (the statements of
one acknowledge-and-claim transaction), ``job`` (each claimed task as a state machine),
``runners`` (threads that run handlers), ``lease`` (the lease keeper), ``maintenance`` (rescue,
retention, cron), then ``inbox``/``listener`` (wake-ups), ``vacuum``, ``supervisor`` (the process
pool) and ``background`` (a worker on a thread of an application)."""
