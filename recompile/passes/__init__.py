"""IR -> IR passes; ``pipeline.PASSES`` lists them in the order they run."""
