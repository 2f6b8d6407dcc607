"""The protocol every collective speaks: the wire (the one header format, tag counter, verdict),
the header round, settling a failed call, the argument checks every call starts with, and the
optional prepared rounds a loop repeats. It imports the algorithms, `plan` and the transport."""
