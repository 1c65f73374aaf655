"""Helpers for testing blockzoo and its plugins (public: plugin authors use them too)."""
