"""Helpers shared by the tests: tiny Hugging Face models, forked launcher ranks, a pause callback."""
