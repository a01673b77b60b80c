"""Operations: what operators read (status) and do (bulk retry, cancel and delete, actions
taken from the console), with the record of every action in one audit table."""
