"""Helpers shared by the test modules (not tests themselves): import them as
``tests.helpers.<module>``; no test module imports another test module."""
