"""The operator console under /console: routes, sign-in, reads, the job browser and its
actions."""
