"""Calibration and held-out text for the pruning tests: paragraphs in the style of the
Python documentation the built-in demo model was trained on, written for these tests."""

CALIBRATION = """\
The list type is a mutable sequence, typically used to store collections of homogeneous
items. Lists may be constructed in several ways: using a pair of square brackets to denote
the empty list, using square brackets and separating items with commas, using a list
comprehension, or using the type constructor. The constructor builds a list whose items are
the same and in the same order as the items of the iterable.

A dictionary maps hashable values to arbitrary objects. Mappings are mutable objects. There
is currently only one standard mapping type, the dictionary. The keys of a dictionary are
almost arbitrary values. Values that are not hashable, that is, values containing lists,
dictionaries or other mutable types, may not be used as keys. Dictionaries can be created
by placing a comma-separated list of key: value pairs within braces.

Strings are immutable sequences of Unicode code points. String literals are written in a
variety of ways: single quotes, double quotes, and triple quoted strings, which may span
multiple lines. All of the whitespace will be included in the string literal. Strings
implement all of the common sequence operations, along with additional methods.

The with statement is used to wrap the execution of a block with methods defined by a
context manager. This allows common try, except and finally usage patterns to be
encapsulated for convenient reuse. The context expression is evaluated to obtain a context
manager, and the manager's enter method is called before the block is executed.

A function definition defines a user-defined function object. The function definition does
not execute the function body; this gets executed only when the function is called. When
one or more parameters have the form parameter = expression, the function is said to have
default parameter values. Default parameter values are evaluated from left to right when
the function definition is executed.

The import statement finds a module, loading and initializing it if necessary, and defines
a name or names in the local namespace for the scope where the import statement occurs.
When a module is first imported, Python searches for the module and, if found, creates a
module object, initializing it. If the named module cannot be found, an error is raised.

Exceptions are raised when an error is detected; they can be handled by the surrounding
code block or by any code block that directly or indirectly invoked the code block where
the error occurred. The try statement specifies exception handlers and cleanup code for a
group of statements. Exceptions are identified by class instances.
"""

HELD_OUT = """\
A set object is an unordered collection of distinct hashable objects. Common uses include
membership testing, removing duplicates from a sequence, and computing mathematical
operations such as intersection, union, difference, and symmetric difference. Like other
collections, sets support membership tests, the len function, and iteration over the set.
Being an unordered collection, sets do not record element position or order of insertion.

The for statement is used to iterate over the elements of a sequence, such as a string,
tuple or list, or other iterable object. The expression list is evaluated once; it should
yield an iterable object. An iterator is created for the result of the expression list.
The suite is then executed once for each item provided by the iterator, in the order
returned by the iterator. When the items are exhausted, the suite in the else clause, if
present, is executed, and the loop terminates.

Class definitions define a class object. A class definition is an executable statement.
The inheritance list usually gives a list of base classes, so each item in the list should
evaluate to a class object which allows subclassing. The class's suite is then executed in
a new execution frame, using a newly created local namespace and the original global
namespace. When the class's suite finishes execution, its execution frame is discarded but
its local namespace is saved.

The open function opens a file and returns a corresponding file object. If the file cannot
be opened, an error is raised. The mode is an optional string that specifies the mode in
which the file is opened. It defaults to reading in text mode. Other common values are
writing, truncating the file if it already exists, and appending.
"""
