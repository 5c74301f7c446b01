"""IR -> IR passes; ``pipeline.passes()`` lists them in the order they run."""
