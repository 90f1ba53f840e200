"""Reports: versioned JSON, Markdown, tables, PNG timelines, graph inspection, the CI gate."""
