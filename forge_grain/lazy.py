"""`lazy`: an attribute made on first use and kept, like `functools.cached_property` but
without its lock.

In Python 3.11 a `cached_property` takes one lock per class while it computes a value: one
instance's slow first computation (a source's store opening from object storage, a content
fingerprint read from its blocks) holds up the first computation of every other instance,
in every thread (Python 3.12 dropped that lock for this reason). The values made here are
pure functions of the instance, so two threads asking at once may both compute one; each
gets an equal value and the last one made is kept.
"""

from __future__ import annotations


class lazy:
    """A descriptor: `obj.<name>` is `make(obj)`, made on first use and kept in the
    instance's `__dict__` (later reads find it there, without calling the descriptor)."""

    def __init__(self, make):
        self.make, self.__doc__ = make, make.__doc__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.make(obj)
        return value
