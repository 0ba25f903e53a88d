"""`picker serve --workers N`: several picker processes on one ext_proc port, one parent."""
