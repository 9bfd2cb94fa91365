"""Images by reference: the content-addressed media store every stage reads, and the
ingestion that turns a user's image parts into references (`schemas.media`)."""
