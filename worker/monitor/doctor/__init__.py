"""`worker doctor`: a health check of the database for the queue, as a list of findings."""
