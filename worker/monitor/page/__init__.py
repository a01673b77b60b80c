"""The one UI of the console and the status page: the document and its panels, the overview both
show, its charts, its sections, markup helpers and the database-health panel."""
