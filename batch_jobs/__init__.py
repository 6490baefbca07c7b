"""Job kinds (OpenAI batch, offline eval, embedding backfill, summaries), the SQLModel store,
chunk planning and result writers."""
