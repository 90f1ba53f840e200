"""The torch.compile backend: the graphs Dynamo hands over, planned, rewritten, compiled and composed into the step they run in."""
